"""Stand-in for ``transformer_engine.pytorch.tensor``: the four quantized tensor modules."""
