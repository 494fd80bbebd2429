"""The size-budget search (``--target-size``/``--target-bpw``) and the error measurements it uses.
"""
