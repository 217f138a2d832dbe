"""The gateway: aiohttp app (websocket + OpenAI API + chat page), continuous-batching scheduler, pipeline client."""
