"""The OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models, stored chat
completions."""
