"""kvforge.spec"""
