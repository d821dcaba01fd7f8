"""kvforge.engine"""
