"""The verdict: its types, the rule, chance allowances, what an error reads as, and the words of each cause."""
