"""kvforge.weights"""
