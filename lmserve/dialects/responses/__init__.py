"""The OpenAI Responses dialect: /v1/responses (stored responses, tools, streaming events) and /v1/conversations."""
