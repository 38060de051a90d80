"""Small text statistics used by the demo task."""


def word_count(text: str) -> int:
    """Number of whitespace-separated words in ``text``."""
    return len(text.split(" "))


def longest_word(text: str) -> str:
    """The longest word in ``text`` ("" for no words)."""
    words = text.split()
    return max(words, key=len) if words else ""
