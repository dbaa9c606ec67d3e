"""Writes reviews.tsv: short synthetic restaurant reviews whose sentiment depends on word order.

"the food was good but the service was bad" is negative; swap the clauses and it is positive,
with the same bag of words. Run: python3 make_reviews.py > reviews.tsv (deterministic).
"""
import random

ASPECTS = ["food", "service", "music", "wine", "staff", "view", "dessert", "coffee", "decor", "menu"]
POSITIVE = ["good", "great", "lovely", "excellent", "superb", "pleasant"]
NEGATIVE = ["bad", "awful", "poor", "terrible", "dreadful", "bland"]
INTENSIFIERS = ["", "", "really ", "quite ", "very ", "truly "]


def adjective(rng, positive):
    return rng.choice(INTENSIFIERS) + rng.choice(POSITIVE if positive else NEGATIVE)


def review(rng):
    kind = rng.choice(["plain", "negated", "but", "although_first", "although_last", "and"])
    a1, a2 = rng.sample(ASPECTS, 2)
    p1 = rng.random() < 0.5
    if kind == "plain":
        return f"the {a1} was {adjective(rng, p1)}", p1
    if kind == "negated":
        return f"the {a1} was not {rng.choice(POSITIVE if p1 else NEGATIVE)}", not p1
    p2 = not p1 if kind != "and" else p1
    c1, c2 = f"the {a1} was {adjective(rng, p1)}", f"the {a2} was {adjective(rng, p2)}"
    if kind == "but":  # the clause after "but" decides
        return f"{c1} but {c2}", p2
    if kind == "although_first":  # "although X, Y": Y decides
        return f"although {c1} {c2}", p2
    if kind == "although_last":  # "X although Y": X decides
        return f"{c1} although {c2}", p1
    return f"{c1} and {c2}", p1


def main():
    rng = random.Random(20261121)
    print("text\tlabel")
    for _ in range(2400):
        text, positive = review(rng)
        print(f"{text}\t{'positive' if positive else 'negative'}")


if __name__ == "__main__":
    main()
