"""Contracts shared by every layer: engines, workflows, typed I/O and configs. Imports nothing
else from the package."""
