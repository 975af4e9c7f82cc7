"""Command-line interface, argparse only: `tome-processors bench`, `eval` and `quality`."""
