"""Playing episodes: loopline's own agent loop (token-exact turns), an agent program's episodes through the endpoint, and the schedulers that claim, play and commit them."""
