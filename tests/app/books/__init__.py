"""Audiobook parsing, text, planning, guide voice and assembly."""
