"""OpenAI-compatible HTTP server for Segue.

protocol.py holds the wire models, errors.py the OpenAI-style error responses, app.py the FastAPI
application and its routes, launch.py the `segue serve` entry point.
"""
