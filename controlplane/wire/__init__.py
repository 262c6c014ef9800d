"""msgspec Structs for every HTTP body and WebSocket message. Unknown fields are rejected."""
