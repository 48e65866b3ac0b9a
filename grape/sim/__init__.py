"""The simulator backend: a SimPy discrete-event model of graphed and eager execution.

It takes the same Programs and kernel graphs as :mod:`grape.cuda`, costs them with a device
profile measured on a real GPU and kernel durations from traces, and returns a Trace in the same
format, so that predictions and recordings are compared like for like.
"""
