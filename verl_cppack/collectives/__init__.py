"""collectives"""
