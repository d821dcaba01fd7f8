"""kvforge.server"""
