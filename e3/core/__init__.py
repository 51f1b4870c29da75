"""The shared vocabulary: names, plans, model cards, exit rules. Imports nothing heavy."""
