"""Integrations with training frameworks (NeMo RL)."""
