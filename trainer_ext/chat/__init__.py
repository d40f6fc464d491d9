"""Chat fine-tuning: data formats, chat templates, assistant-only labels, packing and preference training."""
