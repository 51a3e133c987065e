"""The ground floor: configuration, the run directory, the World, files, the console, the machine.

Every other package uses it; it imports nothing of ours from above it (tests/test_architecture.py checks)."""
