"""accelerate's own example scripts, stock vs trainer_ext with only the imports switched (README.md)."""
