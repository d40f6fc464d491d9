"""Choosing a parallel layout: the candidate layouts of a job on given machines, their memory and communication, a ranking, and its check against real steps."""
