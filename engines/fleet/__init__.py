"""The backend-neutral fleet: the client (routing, membership, retries), launching and supervising
local servers, and the backend factory."""
