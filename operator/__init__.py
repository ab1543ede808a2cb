"""The Shoal operator: kopf handlers (main.py) over pure functions (render, rollout, autoscale, status).

See docs/operator.md. Nothing is imported here, so `shoal operator` stays light.
"""
