"""The serving engine: scheduler and sequences (plain Python), device programs (runner.py), the loop."""
