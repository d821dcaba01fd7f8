"""kvforge.kernels"""
