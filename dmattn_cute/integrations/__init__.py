"""Adapters of flash_dmattn_func to other libraries' attention interfaces.

Each adapter imports its library only when asked to register, so importing dmattn_cute never
imports them.
"""
