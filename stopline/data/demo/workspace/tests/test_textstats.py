import unittest

from textstats import longest_word, word_count


class TextStatsTest(unittest.TestCase):
    def test_word_count_simple(self):
        self.assertEqual(word_count("one two three"), 3)

    def test_word_count_extra_whitespace(self):
        self.assertEqual(word_count("  one   two\nthree  "), 3)

    def test_word_count_empty(self):
        self.assertEqual(word_count(""), 0)

    def test_longest_word(self):
        self.assertEqual(longest_word("a bb ccc"), "ccc")


if __name__ == "__main__":
    unittest.main()
