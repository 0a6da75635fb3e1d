"""OoO-Spec pipeline: data -> traces -> labels -> train -> eval -> upload, plus the speculative runtime."""

__version__ = "0.1.0"
