"""The price book and what cached tokens cost."""
