"""kvforge.eval"""
