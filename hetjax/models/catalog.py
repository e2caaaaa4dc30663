"""The built-in models by name, and the options each takes: no JAX here.

The command line checks `--model` and its options against this table before
JAX loads; `registry.build` makes the models (a test holds the two equal).
"""

MODEL_NAMES = ("mlp", "cnn", "resnet18", "transformer", "resnet50")
KINDS = ("image", "tokens")

# The keyword options `build(name, ...)` accepts (`registry.default_config` has their defaults).
OPTIONS = {
    "mlp": ("hidden", "dropout", "dtype"),
    "cnn": ("features", "hidden", "dropout", "dtype"),
    "resnet18": ("width", "stage_sizes", "small_input", "momentum", "dtype"),
    "transformer": ("d_model", "num_layers", "num_heads", "max_len", "mlp_ratio", "dropout",
                    "dtype", "width"),
    "resnet50": ("width", "stage_sizes", "small_input", "momentum", "dtype"),
}


def with_option(option: str) -> tuple[str, ...]:
  """The models that take `option` (e.g. 'dropout'), for error messages."""
  return tuple(n for n in MODEL_NAMES if option in OPTIONS[n])
