"""Training objectives: one module per method, each composing fastprompt.ops into a scalar loss."""
