"""Stand-in for ``transformer_engine.pytorch`` (see the package docstring).

Real TE registers its reconstructors with ``torch.serialization.add_safe_globals`` here; the
stand-in does not touch torch's global state.
"""
