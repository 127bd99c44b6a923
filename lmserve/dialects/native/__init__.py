"""The local runner's native dialect: /api/chat, /api/generate, /api/embed, the model store's routes."""
