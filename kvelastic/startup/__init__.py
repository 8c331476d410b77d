"""Switching kvelastic on inside a vLLM process.

``activate`` reads the settings, runs the gate and applies the patches (all or
nothing) or leaves vLLM untouched; ``runtime`` holds the one process's state
the patches reach; ``reporting`` writes the start-up lines through vLLM's
logger and turns a refusal into one line and an exit code.
"""
