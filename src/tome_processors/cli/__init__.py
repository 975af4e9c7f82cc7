"""Command-line interface: `tome-processors bench` and `tome-processors eval`."""
