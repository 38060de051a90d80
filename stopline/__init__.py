"""stopline: durable LLM agent tasks on Temporal, where every way a turn can
end is a clean, recorded, honest outcome."""

__version__ = "0.1.0"
