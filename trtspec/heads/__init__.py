"""Draft heads on the target's own features: EAGLE-3 (heads/eagle3.py) and Medusa (heads/medusa.py)."""
