"""Engine integrations; each submodule imports its engine (an optional dependency) when it is imported."""
