"""kvforge.models"""
