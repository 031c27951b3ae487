"""Filled in by later issues; never imports torch outside executor/."""
