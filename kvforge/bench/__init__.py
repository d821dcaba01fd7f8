"""kvforge.bench"""
