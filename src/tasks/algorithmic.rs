//! The length-generalization suite of Delétang et al. (ICLR 2023, "Neural Networks and the
//! Chomsky Hierarchy"), as Ruoss et al. (ACL 2023, "Randomized Positional Encodings Boost Length
//! Generalization of Transformers") run it: fifteen algorithmic tasks, generated from a seed
//! with the semantics of the DeepMind code (google-deepmind/randomized_positional_encodings,
//! `tasks/`), which this file follows task by task.
//!
//! # The tape
//! An example is the task's input symbols followed by one blank output token ([`BLANK`]) for
//! each output symbol. The encoder (no causal mask) is read at the blanks only: a single-output
//! task has one. Three tasks end their answer with an `end` token and pad the rest of the output
//! with `0` (`stack_manipulation`, `binary_addition`, `binary_multiplication`): the loss covers
//! the whole output, the accuracy only the outputs up to and including `end`
//! ([`Tape::counted`]), as DeepMind's `accuracy_mask` does.
//!
//! # Lengths
//! A task's length `L` is its input length, as in the DeepMind code. `modular_arithmetic` needs
//! an odd length and uses `L - 1` when `L` is even; its examples still count as length `L`.
//!
//! | task | level | input (L symbols) | output |
//! | --- | --- | --- | --- |
//! | `even_pairs` | regular | bits | `#01 + #10` is odd (1 symbol) |
//! | `parity_check` | regular | bits | the number of 1s is odd (1) |
//! | `cycle_navigation` | regular | left / stay / right | final position on a 5-cycle (1) |
//! | `modular_arithmetic` | regular | `d op d op ... d`, d < 5, op in `+ - *` | its value mod 5 (1) |
//! | `reverse_string` | DCF | bits | the bits reversed (L) |
//! | `stack_manipulation` | DCF | a stack (bits, bottom first), then pop / push0 / push1 | the final stack, top first, `end`, zeros (L + 1) |
//! | `modular_arithmetic_brackets` | DCF | a bracketed expression over `+ - *`, mod 5 | its value (1) |
//! | `solve_equation` | DCF | a bracketed `+ -` expression with one digit replaced by `x`, `=`, its value | the digit `x` stands for (1) |
//! | `duplicate_string` | CS | bits | the bits twice (2L) |
//! | `missing_duplicate_string` | CS | bits `s s` with one replaced by `?` (`#` pads odd L) | the replaced bit (1) |
//! | `odds_first` | CS | bits | the bits at odd indices, then at even ones (L) |
//! | `binary_addition` | CS | little-endian `n + m` | `n + m` little-endian, `end`, zeros (L + 1) |
//! | `binary_multiplication` | CS | little-endian `n * m` | `n m` little-endian, `end`, zeros (L) |
//! | `compute_sqrt` | CS | an L-bit big-endian number | its integer square root, big-endian (ceil(L / 2)) |
//! | `bucket_sort` | CS | symbols below 5 | the symbols sorted (L) |
//!
//! Where the DeepMind code and its docstrings disagree, poslab follows the code:
//! `odds_first` outputs `s[1::2]` then `s[::2]` (0-based indices: odd first), and
//! `cycle_navigation`'s actions 0, 1, 2 move by -1, 0, +1.
//!
//! The random numbers are poslab's own (ChaCha, from `data_seed`): the distributions are
//! DeepMind's, the draws are not.

use num_bigint::BigUint;
use rand::Rng as _;

use super::{Example, Generator, Label, Objective};
use crate::rng::Rng;

/// The blank output token that fills the output half of every tape.
pub const BLANK: &str = "_";

/// The output token that ends a variable-length answer.
pub const END: &str = "end";

/// Where a task sits in the Chomsky hierarchy (Delétang et al.'s grouping).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Regular languages: a finite-state machine solves them.
    Regular,
    /// Deterministic context-free.
    ContextFree,
    /// Context-sensitive: a linear-bounded tape solves them.
    ContextSensitive,
}

impl Level {
    /// The level in words.
    pub fn name(self) -> &'static str {
        match self {
            Self::Regular => "regular",
            Self::ContextFree => "deterministic context-free",
            Self::ContextSensitive => "context-sensitive",
        }
    }
}

/// One of the fifteen tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Algorithmic {
    /// Whether `#01 + #10` in a bit string is odd.
    EvenPairs,
    /// Whether the number of 1s is odd.
    ParityCheck,
    /// The final position on a 5-cycle after moves left, stay, right.
    CycleNavigation,
    /// The value mod 5 of `d op d op ... d`, `op` in `+ - *`.
    ModularArithmetic,
    /// The bits reversed.
    ReverseString,
    /// The final stack after pops and pushes, top first.
    StackManipulation,
    /// The value mod 5 of a bracketed expression.
    ModularArithmeticBrackets,
    /// The digit `x` stands for in a bracketed `+ -` equation mod 5.
    SolveEquation,
    /// The bits twice.
    DuplicateString,
    /// The bit replaced by `?` in a string written twice.
    MissingDuplicateString,
    /// The bits at odd indices, then at even ones.
    OddsFirst,
    /// The sum of two little-endian binary numbers.
    BinaryAddition,
    /// The product of two little-endian binary numbers.
    BinaryMultiplication,
    /// The integer square root of a big-endian binary number.
    ComputeSqrt,
    /// The symbols (below 5) sorted.
    BucketSort,
}

/// A generated example: input symbols, output classes, and how many outputs count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tape {
    /// The input symbols, words of [`Algorithmic::input_symbols`].
    pub input: Vec<&'static str>,
    /// The output, indices into [`Algorithmic::output_symbols`].
    pub output: Vec<usize>,
    /// The leading outputs the accuracy counts: all of them, or up to and including `end`.
    pub counted: usize,
}

impl Tape {
    fn all_counted(input: Vec<&'static str>, output: Vec<usize>) -> Self {
        let counted = output.len();
        Self {
            input,
            output,
            counted,
        }
    }

    /// A tape whose output ends with `end` (class 2) and zeros after it.
    fn ended(input: Vec<&'static str>, answer: Vec<usize>, output_len: usize) -> Self {
        let counted = answer.len() + 1;
        let mut output = answer;
        output.push(2);
        output.resize(output_len, 0);
        Self {
            input,
            output,
            counted,
        }
    }
}

const BITS: &[&str] = &["0", "1"];
const DIGITS: &[&str] = &["0", "1", "2", "3", "4"];
const BITS_END: &[&str] = &["0", "1", END];
const MODULUS: usize = 5;

impl Algorithmic {
    /// The fifteen tasks, in the paper's order.
    pub const ALL: [Self; 15] = [
        Self::EvenPairs,
        Self::ParityCheck,
        Self::CycleNavigation,
        Self::ModularArithmetic,
        Self::ReverseString,
        Self::StackManipulation,
        Self::ModularArithmeticBrackets,
        Self::SolveEquation,
        Self::DuplicateString,
        Self::MissingDuplicateString,
        Self::OddsFirst,
        Self::BinaryAddition,
        Self::BinaryMultiplication,
        Self::ComputeSqrt,
        Self::BucketSort,
    ];

    /// The name configs write in `kind`.
    pub fn name(self) -> &'static str {
        match self {
            Self::EvenPairs => "even_pairs",
            Self::ParityCheck => "parity_check",
            Self::CycleNavigation => "cycle_navigation",
            Self::ModularArithmetic => "modular_arithmetic",
            Self::ReverseString => "reverse_string",
            Self::StackManipulation => "stack_manipulation",
            Self::ModularArithmeticBrackets => "modular_arithmetic_brackets",
            Self::SolveEquation => "solve_equation",
            Self::DuplicateString => "duplicate_string",
            Self::MissingDuplicateString => "missing_duplicate_string",
            Self::OddsFirst => "odds_first",
            Self::BinaryAddition => "binary_addition",
            Self::BinaryMultiplication => "binary_multiplication",
            Self::ComputeSqrt => "compute_sqrt",
            Self::BucketSort => "bucket_sort",
        }
    }

    /// The task named `name`, if there is one.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Where the task sits in the Chomsky hierarchy.
    pub fn level(self) -> Level {
        match self {
            Self::EvenPairs
            | Self::ParityCheck
            | Self::CycleNavigation
            | Self::ModularArithmetic => Level::Regular,
            Self::ReverseString
            | Self::StackManipulation
            | Self::ModularArithmeticBrackets
            | Self::SolveEquation => Level::ContextFree,
            _ => Level::ContextSensitive,
        }
    }

    /// The input alphabet (the blank is not part of it).
    pub fn input_symbols(self) -> &'static [&'static str] {
        match self {
            Self::EvenPairs
            | Self::ParityCheck
            | Self::ReverseString
            | Self::DuplicateString
            | Self::OddsFirst
            | Self::ComputeSqrt => BITS,
            Self::CycleNavigation => &["left", "stay", "right"],
            Self::ModularArithmetic => &["0", "1", "2", "3", "4", "+", "-", "*"],
            Self::StackManipulation => &["0", "1", "pop", "push0", "push1"],
            Self::ModularArithmeticBrackets => &["0", "1", "2", "3", "4", "+", "-", "*", "(", ")"],
            Self::SolveEquation => &["0", "1", "2", "3", "4", "+", "-", "(", ")", "x", "="],
            Self::MissingDuplicateString => &["0", "1", "?", "#"],
            Self::BinaryAddition => &["0", "1", "+"],
            Self::BinaryMultiplication => &["0", "1", "*"],
            Self::BucketSort => DIGITS,
        }
    }

    /// The output classes.
    pub fn output_symbols(self) -> &'static [&'static str] {
        match self {
            Self::EvenPairs
            | Self::ParityCheck
            | Self::ReverseString
            | Self::DuplicateString
            | Self::MissingDuplicateString
            | Self::OddsFirst
            | Self::ComputeSqrt => BITS,
            Self::CycleNavigation
            | Self::ModularArithmetic
            | Self::ModularArithmeticBrackets
            | Self::SolveEquation
            | Self::BucketSort => DIGITS,
            Self::StackManipulation | Self::BinaryAddition | Self::BinaryMultiplication => BITS_END,
        }
    }

    /// Output symbols for an input of length `length`.
    pub fn output_length(self, length: usize) -> usize {
        match self {
            Self::ReverseString | Self::OddsFirst | Self::BucketSort => length,
            Self::BinaryMultiplication => length,
            Self::StackManipulation | Self::BinaryAddition => length + 1,
            Self::DuplicateString => 2 * length,
            Self::ComputeSqrt => length.div_ceil(2),
            _ => 1,
        }
    }

    /// Tokens of a tape of length `length`: inputs then blanks.
    pub fn tape_len(self, length: usize) -> usize {
        let input = match self {
            Self::ModularArithmetic if length.is_multiple_of(2) => length - 1,
            _ => length,
        };
        input + self.output_length(length)
    }

    /// A random example of input length `length` (at least 1).
    pub fn sample(self, rng: &mut Rng, length: usize) -> Tape {
        let l = length.max(1);
        let tape = match self {
            Self::EvenPairs => {
                let s = draw(rng, l, 2);
                let changes = s.windows(2).filter(|w| w[0] != w[1]).count();
                Tape::all_counted(words(&s, BITS), vec![changes % 2])
            }
            Self::ParityCheck => {
                let s = draw(rng, l, 2);
                let ones: usize = s.iter().sum();
                Tape::all_counted(words(&s, BITS), vec![ones % 2])
            }
            Self::CycleNavigation => {
                // Action a moves by a - 1; the walk starts at 0 on a cycle of 5.
                let a = draw(rng, l, 3);
                let position = a
                    .iter()
                    .fold(0i64, |p, &x| p + x as i64 - 1)
                    .rem_euclid(MODULUS as i64);
                Tape::all_counted(words(&a, self.input_symbols()), vec![position as usize])
            }
            Self::ModularArithmetic => {
                let (input, value) = modular_expression(rng, l);
                Tape::all_counted(input, vec![value])
            }
            Self::ReverseString => {
                let s = draw(rng, l, 2);
                let out = s.iter().rev().copied().collect();
                Tape::all_counted(words(&s, BITS), out)
            }
            Self::StackManipulation => stack_manipulation(rng, l),
            Self::ModularArithmeticBrackets => {
                let (input, value) = bracket_expression(rng, l, true);
                Tape::all_counted(input, vec![value])
            }
            Self::SolveEquation => solve_equation(rng, l),
            Self::DuplicateString => {
                let s = draw(rng, l, 2);
                let out = s.iter().chain(&s).copied().collect();
                Tape::all_counted(words(&s, BITS), out)
            }
            Self::MissingDuplicateString => missing_duplicate(rng, l),
            Self::OddsFirst => {
                let s = draw(rng, l, 2);
                let out = s
                    .iter()
                    .skip(1)
                    .step_by(2)
                    .chain(s.iter().step_by(2))
                    .copied()
                    .collect();
                Tape::all_counted(words(&s, BITS), out)
            }
            Self::BinaryAddition => binary_operation(rng, l, false),
            Self::BinaryMultiplication => binary_operation(rng, l, true),
            Self::ComputeSqrt => {
                let n = random_nonzero(rng, l);
                let input = big_endian(&n, l);
                let root = big_endian(&n.sqrt(), l.div_ceil(2));
                Tape::all_counted(words(&input, BITS), root)
            }
            Self::BucketSort => {
                let s = draw(rng, l, MODULUS);
                let mut out = s.clone();
                out.sort_unstable();
                Tape::all_counted(words(&s, DIGITS), out)
            }
        };
        debug_assert_eq!(tape.output.len(), self.output_length(l), "{}", self.name());
        debug_assert_eq!(
            tape.input.len() + tape.output.len(),
            self.tape_len(l),
            "{}",
            self.name()
        );
        tape
    }
}

impl Algorithmic {
    /// The answer to `input` (a task's input symbols, of length `L = input.len()`), computed
    /// from the input alone, independently of how [`Algorithmic::sample`] made it: the check
    /// that generation is right, and the reference for hand-written examples. `None` when
    /// `input` is not a well-formed input of the task.
    pub fn solve(self, input: &[&str]) -> Option<Tape> {
        let l = input.len();
        if l == 0 {
            return None;
        }
        let alphabet = self.input_symbols();
        let ids: Vec<usize> = input
            .iter()
            .map(|w| alphabet.iter().position(|a| a == w))
            .collect::<Option<_>>()?;
        // The input as the alphabet's own words.
        let words: Vec<&'static str> = ids.iter().map(|&i| alphabet[i]).collect();
        let own = |output: Vec<usize>| Some(Tape::all_counted(words.clone(), output));
        let bits = |s: &[usize]| s.iter().all(|&b| b < 2);
        match self {
            Self::EvenPairs => own(vec![ids.windows(2).filter(|w| w[0] != w[1]).count() % 2]),
            Self::ParityCheck => own(vec![ids.iter().sum::<usize>() % 2]),
            Self::CycleNavigation => own(vec![
                (ids.iter().sum::<usize>() + (MODULUS - 1) * l) % MODULUS,
            ]),
            Self::ModularArithmetic => own(vec![evaluate_flat(input)?]),
            Self::ReverseString => own(ids.iter().rev().copied().collect()),
            Self::StackManipulation => {
                // Bits first (the stack, bottom first), then actions only.
                let split = ids.iter().position(|&a| a >= 2).unwrap_or(l);
                if !bits(&ids[..split]) || ids[split..].iter().any(|&a| a < 2) || split == 0 {
                    return None;
                }
                let mut stack = ids[..split].to_vec();
                for &a in &ids[split..] {
                    match a {
                        2 => {
                            stack.pop();
                        }
                        push => stack.push(push - 3),
                    }
                }
                stack.reverse();
                Some(Tape::ended(words, stack, l + 1))
            }
            Self::ModularArithmeticBrackets => {
                let (value, rest) = evaluate_brackets(input)?;
                rest.is_empty().then(|| own(vec![value]))?
            }
            Self::SolveEquation => {
                if l < 3 {
                    return input.iter().all(|w| *w == "0").then(|| own(vec![0]))?;
                }
                // `expression = v` with one `x`: the digit that makes it true (unique, as x
                // enters with coefficient +1 or -1 mod 5).
                let (expr, value) = (&input[..l - 2], input[l - 1]);
                if input[l - 2] != "=" || expr.iter().filter(|w| **w == "x").count() != 1 {
                    return None;
                }
                let value = DIGITS.iter().position(|d| *d == value)?;
                let fits: Vec<usize> = (0..MODULUS)
                    .filter(|&d| {
                        let e: Vec<&str> = expr
                            .iter()
                            .map(|w| if *w == "x" { DIGITS[d] } else { w })
                            .collect();
                        matches!(evaluate_brackets(&e), Some((v, [])) if v == value)
                    })
                    .collect();
                (fits.len() == 1).then(|| own(fits))?
            }
            Self::DuplicateString => own(ids.iter().chain(&ids).copied().collect()),
            Self::MissingDuplicateString => {
                if l == 1 {
                    return (ids == [1]).then(|| own(vec![1]))?;
                }
                let half = l / 2;
                if l % 2 == 1 && ids[l - 1] != 3 {
                    return None;
                }
                let doubled = &ids[..2 * half];
                let gap = doubled.iter().position(|&s| s == 2)?;
                let twin = |i: usize| (i + half) % (2 * half);
                // Two equal halves of bits, but for the one gap.
                let well_formed = (0..2 * half).all(|i| {
                    i == gap || twin(i) == gap || (doubled[i] < 2 && doubled[i] == doubled[twin(i)])
                });
                (well_formed && doubled[twin(gap)] < 2).then(|| own(vec![doubled[twin(gap)]]))?
            }
            Self::OddsFirst => own(ids
                .iter()
                .skip(1)
                .step_by(2)
                .chain(ids.iter().step_by(2))
                .copied()
                .collect()),
            Self::BinaryAddition | Self::BinaryMultiplication => {
                let multiply = self == Self::BinaryMultiplication;
                let output_len = if multiply { l } else { l + 1 };
                let answer = if l <= 2 {
                    if !bits(&ids) {
                        return None;
                    }
                    if multiply {
                        vec![0; l - 1]
                    } else {
                        let n: usize = ids.iter().enumerate().map(|(i, b)| b << i).sum();
                        little_endian(&BigUint::from(n))
                    }
                } else {
                    let op = ids.iter().position(|&s| s == 2)?;
                    let (n, m) = (&ids[..op], &ids[op + 1..]);
                    if n.is_empty() || m.is_empty() || !bits(n) || !bits(m) {
                        return None;
                    }
                    let number = |d: &[usize]| {
                        let d: Vec<u8> = d.iter().map(|&b| b as u8).collect();
                        BigUint::from_radix_le(&d, 2)
                    };
                    let (n, m) = (number(n)?, number(m)?);
                    little_endian(&if multiply { &n * &m } else { &n + &m })
                };
                (answer.len() < output_len).then(|| Tape::ended(words, answer, output_len))
            }
            Self::ComputeSqrt => {
                let d: Vec<u8> = ids.iter().rev().map(|&b| b as u8).collect();
                let n = BigUint::from_radix_le(&d, 2)?;
                own(big_endian(&n.sqrt(), l.div_ceil(2)))
            }
            Self::BucketSort => {
                let mut out = ids.clone();
                out.sort_unstable();
                own(out)
            }
        }
    }
}

/// `d op d ... d` with `*` before `+` and `-`, mod 5; `None` unless digits and operators
/// alternate.
fn evaluate_flat(input: &[&str]) -> Option<usize> {
    let m = MODULUS as i64;
    let digit = |w: &str| DIGITS.iter().position(|d| *d == w).map(|d| d as i64);
    let mut total = 0i64;
    let mut sign = 1i64;
    let mut term = digit(input.first()?)?;
    for pair in input[1..].chunks(2) {
        let [op, d] = pair else { return None };
        let d = digit(d)?;
        match *op {
            "*" => term = term * d % m,
            "+" | "-" => {
                total = (total + sign * term).rem_euclid(m);
                sign = if *op == "+" { 1 } else { -1 };
                term = d;
            }
            _ => return None,
        }
    }
    Some((total + sign * term).rem_euclid(m) as usize)
}

/// Parses one expression of the brackets grammar (`d`, `-d`, `(d)`, `(-d)`, `(e op e)`) from
/// the front of `input`: its value mod 5 and the rest of the input.
fn evaluate_brackets<'a, 'b>(input: &'a [&'b str]) -> Option<(usize, &'a [&'b str])> {
    let m = MODULUS;
    let digit = |w: &str| DIGITS.iter().position(|d| *d == w);
    match input.first()? {
        &"-" => Some(((m - digit(input.get(1)?)?) % m, &input[2..])),
        &"(" => {
            // `(-d)`; a `(-d op e)` goes on below, its left operand being `-d`.
            if input.get(1) == Some(&"-") && input.get(3) == Some(&")") {
                let d = digit(input.get(2)?)?;
                return Some(((m - d) % m, &input[4..]));
            }
            let (a, rest) = evaluate_brackets(&input[1..])?;
            match rest.first()? {
                &")" => Some((a, &rest[1..])),
                op => {
                    let (b, rest) = evaluate_brackets(&rest[1..])?;
                    let value = match *op {
                        "+" => (a + b) % m,
                        "-" => (a + m - b) % m,
                        "*" => a * b % m,
                        _ => return None,
                    };
                    (rest.first() == Some(&")")).then(|| (value, &rest[1..]))
                }
            }
        }
        w => Some((digit(w)?, &input[1..])),
    }
}

/// `n` symbols uniform below `k`.
fn draw(rng: &mut Rng, n: usize, k: usize) -> Vec<usize> {
    (0..n).map(|_| rng.random_range(0..k)).collect()
}

fn words(symbols: &[usize], alphabet: &[&'static str]) -> Vec<&'static str> {
    symbols.iter().map(|&s| alphabet[s]).collect()
}

/// `d op d op ... d` of odd length (`l - 1` when `l` is even), numbers uniform below 5 and
/// operators uniform in `+ * -`; its value with `*` before `+` and `-`, mod 5 (DeepMind's
/// `modular_arithmetic.py`: a `-` negates the term after it).
fn modular_expression(rng: &mut Rng, l: usize) -> (Vec<&'static str>, usize) {
    let l = if l.is_multiple_of(2) { l - 1 } else { l };
    let m = MODULUS as i64;
    let mut input = Vec::with_capacity(l);
    let (mut total, mut sign, mut term) = (0i64, 1i64, 0i64);
    for i in 0..l {
        if i % 2 == 0 {
            let d = rng.random_range(0..MODULUS);
            input.push(DIGITS[d]);
            let d = d as i64;
            // The first number of a term starts it; after `*` it multiplies it.
            term = if i > 0 && input[i - 1] == "*" {
                term * d % m
            } else {
                d
            };
        } else {
            let op = ["+", "*", "-"][rng.random_range(0..3)];
            if op != "*" {
                total = (total + sign * term).rem_euclid(m);
                sign = if op == "+" { 1 } else { -1 };
            }
            input.push(op);
        }
    }
    total = (total + sign * term).rem_euclid(m);
    (input, total as usize)
}

/// A bracketed expression of exactly `l` symbols and its value mod 5 (DeepMind's
/// `generate_one_expression_and_result`): `d`, `-d`, `(d)`, `(-d)` for lengths 1 to 4; longer,
/// `(left op right)` with `left` of a uniform length in `[1, l - 4]` and `op` uniform in `+ -`
/// (and `*` when `mult`).
fn bracket_expression(rng: &mut Rng, l: usize, mult: bool) -> (Vec<&'static str>, usize) {
    let m = MODULUS;
    let digit = |rng: &mut Rng| rng.random_range(0..m);
    match l {
        0 | 1 => {
            let d = digit(rng);
            (vec![DIGITS[d]], d)
        }
        2 => {
            let d = digit(rng);
            (vec!["-", DIGITS[d]], (m - d) % m)
        }
        3 => {
            let d = digit(rng);
            (vec!["(", DIGITS[d], ")"], d)
        }
        4 => {
            let d = digit(rng);
            (vec!["(", "-", DIGITS[d], ")"], (m - d) % m)
        }
        _ => {
            let left_len = rng.random_range(1..l - 3);
            let right_len = l - left_len - 3;
            let (left, a) = bracket_expression(rng, left_len, mult);
            let (right, b) = bracket_expression(rng, right_len, mult);
            let (op, value) = match rng.random_range(0..if mult { 3 } else { 2 }) {
                0 => ("+", (a + b) % m),
                1 => ("-", (a + m - b) % m),
                _ => ("*", a * b % m),
            };
            let mut s = Vec::with_capacity(l);
            s.push("(");
            s.extend(left);
            s.push(op);
            s.extend(right);
            s.push(")");
            (s, value)
        }
    }
}

/// DeepMind's `solve_equation.py`: a `+ -` bracketed expression of length `l - 2`, one digit
/// (the first at or after a uniform index, wrapping) replaced by `x`, then `=` and the value;
/// the answer is the replaced digit. Below length 3, all zeros with answer 0.
fn solve_equation(rng: &mut Rng, l: usize) -> Tape {
    if l < 3 {
        return Tape::all_counted(vec!["0"; l], vec![0]);
    }
    let (mut expr, value) = bracket_expression(rng, l - 2, false);
    let mut i = rng.random_range(0..expr.len());
    while !DIGITS.contains(&expr[i]) {
        i = (i + 1) % expr.len();
    }
    let answer = DIGITS.iter().position(|d| *d == expr[i]).expect("a digit");
    expr[i] = "x";
    expr.push("=");
    expr.push(DIGITS[value]);
    Tape::all_counted(expr, vec![answer])
}

/// DeepMind's `stack_manipulation.py`: a stack of uniform length in `[1, l - 1]` (bits, bottom
/// first), then uniform actions pop / push0 / push1 (a pop of an empty stack does nothing); the
/// output is the final stack top first, `end`, zeros to `l + 1`. Length 1 is one bit, which is
/// also the answer.
fn stack_manipulation(rng: &mut Rng, l: usize) -> Tape {
    const ACTIONS: [&str; 3] = ["pop", "push0", "push1"];
    if l == 1 {
        let b = rng.random_range(0..2);
        return Tape::ended(vec![BITS[b]], vec![b], 2);
    }
    let stack_len = rng.random_range(1..l);
    let mut stack = draw(rng, stack_len, 2);
    let mut input = words(&stack, BITS);
    for _ in stack_len..l {
        let a = rng.random_range(0..3);
        input.push(ACTIONS[a]);
        match a {
            0 => {
                stack.pop();
            }
            push => stack.push(push - 1),
        }
    }
    stack.reverse();
    Tape::ended(input, stack, l + 1)
}

/// DeepMind's `missing_duplicate_string.py`: `s s` for `s` of `l / 2` uniform bits, one position
/// (uniform) replaced by `?` and `#` appended when `l` is odd; the answer is the replaced bit.
/// Length 1 is the input `1` with answer 1.
fn missing_duplicate(rng: &mut Rng, l: usize) -> Tape {
    if l == 1 {
        return Tape::all_counted(vec!["1"], vec![1]);
    }
    let half = draw(rng, l / 2, 2);
    let mut doubled: Vec<&'static str> = words(&half, BITS).repeat(2);
    let i = rng.random_range(0..doubled.len());
    let answer = half[i % half.len()];
    doubled[i] = "?";
    if l % 2 == 1 {
        doubled.push("#");
    }
    Tape::all_counted(doubled, vec![answer])
}

/// DeepMind's `binary_addition.py` and `binary_multiplication.py`: `n op m` little-endian, the
/// lengths of `n` uniform in `[1, l - 2]` and of `m` the rest, each number uniform in
/// `[1, 2^len - 1]` (so it may end in zeros); the answer little-endian without trailing zeros,
/// then `end` and zeros to `l + 1` (addition) or `l` (multiplication). For `l <= 2` the input is
/// a number uniform in `[0, 2^l - 1)` written in `l` bits, and the answer that number
/// (addition) or `l - 1` zeros (multiplication).
fn binary_operation(rng: &mut Rng, l: usize, multiply: bool) -> Tape {
    let (op, output_len) = if multiply { ("*", l) } else { ("+", l + 1) };
    if l <= 2 {
        let n = rng.random_range(0..(1usize << l) - 1);
        let input: Vec<usize> = (0..l).map(|i| (n >> i) & 1).collect();
        let answer = if multiply {
            vec![0; l - 1]
        } else {
            little_endian(&BigUint::from(n))
        };
        return Tape::ended(words(&input, BITS), answer, output_len);
    }
    let len_n = rng.random_range(1..l - 1);
    let len_m = l - 1 - len_n;
    let (n, m) = (random_nonzero(rng, len_n), random_nonzero(rng, len_m));
    let mut input = words(&padded_little_endian(&n, len_n), BITS);
    input.push(op);
    input.extend(words(&padded_little_endian(&m, len_m), BITS));
    let result = if multiply { &n * &m } else { &n + &m };
    Tape::ended(input, little_endian(&result), output_len)
}

/// A number uniform in `[1, 2^bits - 1]`: `bits` fair bits, redrawn while all zero.
fn random_nonzero(rng: &mut Rng, bits: usize) -> BigUint {
    loop {
        let digits: Vec<u8> = (0..bits).map(|_| rng.random_range(0..2u8)).collect();
        if digits.contains(&1) {
            return BigUint::from_radix_le(&digits, 2).expect("binary digits");
        }
    }
}

/// Binary digits, least significant first, without trailing zeros (`0` is `[0]`).
fn little_endian(n: &BigUint) -> Vec<usize> {
    n.to_radix_le(2).into_iter().map(usize::from).collect()
}

/// `n` in exactly `bits` binary digits, least significant first.
fn padded_little_endian(n: &BigUint, bits: usize) -> Vec<usize> {
    let mut d = little_endian(n);
    d.resize(bits, 0);
    d
}

/// `n` in exactly `bits` binary digits, most significant first.
fn big_endian(n: &BigUint, bits: usize) -> Vec<usize> {
    let mut d = padded_little_endian(n, bits);
    d.reverse();
    d
}

/// A task of the suite as a generated task: its tape of inputs then blanks, tagged at the
/// blanks with the output symbols.
impl Generator for Algorithmic {
    fn check(&self, _shortest: usize, _longest: usize) -> std::result::Result<(), String> {
        Ok(())
    }

    fn objective(&self) -> (Objective, Vec<String>) {
        (
            Objective::Tag {
                labels: self
                    .output_symbols()
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
            },
            self.input_symbols()
                .iter()
                .chain([&BLANK])
                .map(|s| s.to_string())
                .collect(),
        )
    }

    fn example(&self, rng: &mut Rng, len: usize) -> Example {
        let tape = self.sample(rng, len);
        let words = tape
            .input
            .iter()
            .copied()
            .chain(std::iter::repeat_n(BLANK, tape.output.len()))
            .map(String::from)
            .collect();
        Example::new(
            words,
            Label::Outputs {
                length: len,
                targets: tape.output,
                counted: tape.counted,
            },
        )
    }

    fn words_at(&self, len: usize) -> usize {
        self.tape_len(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn num(bits_le: &[usize]) -> BigUint {
        let d: Vec<u8> = bits_le.iter().map(|&b| b as u8).collect();
        BigUint::from_radix_le(&d, 2).unwrap()
    }

    #[test]
    fn names_round_trip_and_levels_follow_the_paper() {
        for t in Algorithmic::ALL {
            assert_eq!(Algorithmic::from_name(t.name()), Some(t));
        }
        let count = |level| {
            Algorithmic::ALL
                .iter()
                .filter(|t| t.level() == level)
                .count()
        };
        assert_eq!(
            (
                count(Level::Regular),
                count(Level::ContextFree),
                count(Level::ContextSensitive)
            ),
            (4, 4, 7)
        );
        assert_eq!(Algorithmic::from_name("reverse"), None);
    }

    #[test]
    fn the_blank_and_end_are_no_input_symbol() {
        for t in Algorithmic::ALL {
            assert!(!t.input_symbols().contains(&BLANK), "{}", t.name());
            let mut seen = std::collections::HashSet::new();
            assert!(t.input_symbols().iter().all(|s| seen.insert(*s)));
        }
    }

    #[test]
    fn little_endian_arithmetic_matches_the_docstrings() {
        // binary_addition.py: 001 + 01101 = 4 + 22 = 26 = 01011 little-endian.
        let (n, m) = (num(&[0, 0, 1]), num(&[0, 1, 1, 0, 1]));
        assert_eq!((&n + &m), BigUint::from(26u32));
        assert_eq!(little_endian(&(&n + &m)), vec![0, 1, 0, 1, 1]);
        // binary_multiplication.py: 001 * 01101 = 88 = 0001101 little-endian.
        assert_eq!(little_endian(&(&n * &m)), vec![0, 0, 0, 1, 1, 0, 1]);
        // compute_sqrt.py: 100101 = 37 -> 6 = 110 big-endian; 111 = 7 -> 2 = 10.
        assert_eq!(big_endian(&BigUint::from(37u32).sqrt(), 3), vec![1, 1, 0]);
        assert_eq!(big_endian(&BigUint::from(7u32).sqrt(), 2), vec![1, 0]);
        assert_eq!(little_endian(&BigUint::from(0u32)), vec![0]);
        assert_eq!(
            padded_little_endian(&BigUint::from(2u32), 4),
            vec![0, 1, 0, 0]
        );
    }
}
