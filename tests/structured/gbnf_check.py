#!/usr/bin/env python3
"""An independent GBNF recognizer: does a text belong to a grammar's language?

    gbnf_check.py GRAMMAR.gbnf < text            exit 0 if it matches from `root` to the end, 1 if not
    gbnf_check.py --prefix GRAMMAR.gbnf < text   exit 0 if some text in the language starts so

The grammar is read here (its own parser, not infer's) into character-level rules and the text is
checked with an Earley recognizer, so a test can hold infer's constrained output to the grammar
without trusting the engine that produced it.
"""
import sys


class Grammar:
    def __init__(self):
        self.rules = {}  # name -> list of alternatives; an alternative is a list of symbols
        self.n = 0

    def fresh(self, base):
        self.n += 1
        return f"{base}#{self.n}"

    def add(self, name, alt):
        self.rules.setdefault(name, []).append(alt)


def parse(src):
    """GBNF text -> Grammar. Symbols: ('r', name) rule, ('c', pred) one character."""
    g = Grammar()
    i = 0

    def skip(nl):
        nonlocal i
        while i < len(src):
            c = src[i]
            if c in " \t" or (nl and c in "\r\n"):
                i += 1
            elif c == "#":
                while i < len(src) and src[i] not in "\r\n":
                    i += 1
            else:
                break

    def char():
        nonlocal i
        c = src[i]
        i += 1
        if c != "\\":
            return c
        e = src[i]
        i += 1
        simple = {"n": "\n", "r": "\r", "t": "\t"}
        if e in simple:
            return simple[e]
        if e in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[e]
            v = chr(int(src[i:i + n], 16))
            i += n
            return v
        return e

    def name():
        nonlocal i
        s = i
        while i < len(src) and (src[i].isalnum() or src[i] == "-"):
            i += 1
        assert i > s, f"name expected at {i}"
        return src[s:i]

    def alternatives(nested):
        nonlocal i
        alts = [sequence(nested)]
        while i < len(src) and src[i] == "|":
            i += 1
            skip(True)
            alts.append(sequence(nested))
        return alts

    def group(alts):
        n = g.fresh("group")
        for a in alts:
            g.add(n, a)
        return ("r", n)

    def sequence(nested):
        nonlocal i
        seq = []
        while i < len(src):
            c = src[i]
            if c == '"':
                i += 1
                lit = []
                while src[i] != '"':
                    lit.append(char())
                i += 1
                item = [("c", (lambda ch, x=x: ch == x)) for x in lit]
            elif c == "[":
                i += 1
                neg = src[i] == "^"
                if neg:
                    i += 1
                ranges = []
                while src[i] != "]":
                    a = char()
                    b = a
                    if src[i] == "-" and src[i + 1] != "]":
                        i += 1
                        b = char()
                    ranges.append((a, b))
                i += 1
                item = [("c", lambda ch, r=ranges, n=neg: any(a <= ch <= b for a, b in r) != n)]
            elif c == ".":
                i += 1
                item = [("c", lambda ch: True)]
            elif c == "(":
                i += 1
                skip(True)
                alts = alternatives(True)
                assert src[i] == ")"
                i += 1
                item = [group(alts)]
            elif c.isalnum() or c == "-":
                item = [("r", name())]
            else:
                break
            skip(nested)
            if i < len(src) and src[i] in "*+?{":
                lo, hi = repetition()
                item = [repeat(item, lo, hi)]
            seq.extend(item)
            skip(nested)
        return seq

    def repetition():
        nonlocal i
        c = src[i]
        i += 1
        if c == "*":
            return 0, None
        if c == "+":
            return 1, None
        if c == "?":
            return 0, 1
        j = src.index("}", i)
        body = src[i:j].replace(" ", "")
        i = j + 1
        if "," in body:
            a, b = body.split(",")
            return int(a), (int(b) if b else None)
        return int(body), int(body)

    def repeat(item, lo, hi):
        # item{lo,hi} as: item^lo then (hi-lo optional items) or a star.
        n = g.fresh("rep")
        if hi is None:
            star = g.fresh("star")
            g.add(star, [])
            g.add(star, item + [("r", star)])
            g.add(n, item * lo + [("r", star)])
        else:
            opt = g.fresh("opt")
            g.add(opt, [])
            prev = opt
            for _ in range(hi - lo):
                nxt = g.fresh("opt")
                g.add(nxt, [])
                g.add(nxt, item + [("r", prev)])
                prev = nxt
            g.add(n, item * lo + [("r", prev)])
        return ("r", n)

    skip(True)
    while i < len(src):
        rule = name()
        skip(False)
        assert src[i:i + 3] == "::=", f"::= expected at {i}"
        i += 3
        skip(True)
        for a in alternatives(False):
            g.add(rule, a)
        skip(True)
    return g


def recognizes(g, text, start="root", prefix=False):
    """Earley recognition of `text` from `start` (with `prefix`: of some text that starts so)."""
    n = len(text)
    chart = [set() for _ in range(n + 1)]  # items (rule, alt index, dot, origin)
    chart[0] = {(start, k, 0, 0) for k in range(len(g.rules[start]))}
    nullable = set()
    changed = True
    while changed:  # rules that derive the empty string, for completion at the same position
        changed = False
        for r, alts in g.rules.items():
            if r not in nullable and any(all(s[0] == "r" and s[1] in nullable for s in a) for a in alts):
                nullable.add(r)
                changed = True
    for pos in range(n + 1):
        todo = list(chart[pos])
        while todo:
            r, k, dot, org = todo.pop()
            alt = g.rules[r][k]
            if dot == len(alt):
                for (r2, k2, d2, o2) in list(chart[org]):
                    a2 = g.rules[r2][k2]
                    if d2 < len(a2) and a2[d2] == ("r", r):
                        it = (r2, k2, d2 + 1, o2)
                        if it not in chart[pos]:
                            chart[pos].add(it)
                            todo.append(it)
                continue
            kind, v = alt[dot]
            if kind == "r":
                for k2 in range(len(g.rules[v])):
                    it = (v, k2, 0, pos)
                    if it not in chart[pos]:
                        chart[pos].add(it)
                        todo.append(it)
                if v in nullable:
                    it = (r, k, dot + 1, org)
                    if it not in chart[pos]:
                        chart[pos].add(it)
                        todo.append(it)
            elif pos < n and v(text[pos]):
                chart[pos + 1].add((r, k, dot + 1, org))
    if prefix:
        # Something was scanned up to the end: the text can still be completed.
        return bool(chart[n])
    return any(r == start and org == 0 and d == len(g.rules[r][k]) for (r, k, d, org) in chart[n])


if __name__ == "__main__":
    prefix = sys.argv[1] == "--prefix"
    grammar = parse(open(sys.argv[-1], encoding="utf-8").read())
    text = sys.stdin.read()
    ok = recognizes(grammar, text, prefix=prefix)
    print("match" if ok else "no match")
    sys.exit(0 if ok else 1)
