"""OpenAI-compatible HTTP server for Segue (see README.md in this folder).

app.py builds the application; routes_*.py hold the endpoints; tool_loop.py drives one chat
response through server-side tool rounds; sessions.py keeps paused requests between client turns;
launch.py is the `segue serve` entry point.
"""
