"""kvforge.plan"""
