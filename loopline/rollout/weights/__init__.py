"""How each version's weights reach a host: published by URI, served by the trainer, checked before a server loads them."""
