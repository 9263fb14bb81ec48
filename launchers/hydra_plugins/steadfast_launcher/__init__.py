"""Steadfast: a Hydra launcher that runs every job as a fault-tolerant distributed job.

Public modules here are imported by Hydra's plugin scan at every start, so they stay
cheap (no torch). The heavy work lives in the underscore modules.
"""
