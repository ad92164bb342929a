"""A discrete-event simulator of PrfaaS-PD deployments that drives the live router's policy objects
(router/policies/) against instance models built from profiles (router/planner.py). See run.py."""
