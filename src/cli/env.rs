//! The environment variables poslab reads, and the values each accepts. Only the command line
//! reads them (the library takes every choice as a value): once, at start, into the values it
//! passes on ([`super::Compute::backend`], [`limits`]). A value poslab cannot read is an error
//! that says the accepted forms (never a silent fallback to the default), and the `poslab`
//! binary checks every one at start ([`check`]), warning of `POSLAB_*` names it does not know
//! (a typo would otherwise be ignored).

/// A variable poslab reads: its name, what it accepts, and how a value is checked.
pub struct Var {
    /// The variable's name.
    pub name: &'static str,
    /// The values it accepts, in words (for error messages).
    pub accepts: &'static str,
    check: fn(&str) -> Result<(), String>,
}

fn size(v: &str) -> Result<(), String> {
    parse_size(v).map(|_| ())
}
fn kernels_value(v: &str) -> Result<(), String> {
    parse_kernels(v).map(|_| ())
}
/// `reference`, `ops` or `layer`.
fn parse_kernels(v: &str) -> Result<poslab::nn::Kernels, String> {
    poslab::nn::Kernels::parse(v).ok_or_else(|| "not reference, ops or layer".into())
}
fn one(v: &str) -> Result<(), String> {
    match v {
        "1" => Ok(()),
        _ => Err("not 1".into()),
    }
}
fn path(v: &str) -> Result<(), String> {
    if v.is_empty() {
        Err("empty".into())
    } else {
        Ok(())
    }
}

/// Every variable poslab (or one of its scripts and tests) reads.
pub const VARS: &[Var] = &[
    Var {
        name: "POSLAB_MAX_PARAMS",
        accepts: "the most parameters a model may have: a whole number, optionally followed by \
                  K, M, G or T (powers of 1024), such as 500000000 or 4G",
        check: size,
    },
    Var {
        name: "POSLAB_MAX_MEMORY",
        accepts: "the most bytes a batch's activations may take (default: 32G, or three \
                  quarters of the memory the process may use where that is less): a whole \
                  number, optionally followed by K, M, G or T (powers of 1024), such as 8G",
        check: size,
    },
    Var {
        name: "POSLAB_KERNELS",
        accepts: "the CPU kernels: reference, ops or layer",
        check: kernels_value,
    },
    Var {
        name: "POSLAB_DEFAULT_ALLOCATOR",
        accepts: "1, to keep glibc's allocator settings",
        check: one,
    },
    Var {
        name: "POSLAB_TORCH_REFERENCE",
        accepts: "the path of the PyTorch reference script (bench --torch)",
        check: path,
    },
    Var {
        name: "POSLAB_FIXTURES",
        accepts: "a folder of encoder_*.safetensors fixtures (the tests)",
        check: path,
    },
    Var {
        name: "POSLAB_MINILM",
        accepts: "the all-MiniLM-L6-v2 folder (the tests)",
        check: path,
    },
    Var {
        name: "POSLAB_SHARED",
        accepts: "the shared/ folder (scripts/gpu/prepare.sh)",
        check: path,
    },
];

/// `N`, `NK`, `NM`, `NG` or `NT` (powers of 1024; lower case too), at least 1.
pub fn parse_size(v: &str) -> Result<u64, String> {
    let t = v.trim();
    let (digits, scale) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1u64 << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&t[..i], 1 << 30),
        Some((i, 't' | 'T')) => (&t[..i], 1 << 40),
        _ => (t, 1),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err("not a whole number with an optional K, M, G or T".into());
    }
    let n: u64 = digits.parse().map_err(|_| "more than 2^64".to_string())?;
    match n.checked_mul(scale) {
        None => Err("more than 2^64".into()),
        Some(0) => Err("0: it must be at least 1".into()),
        Some(n) => Ok(n),
    }
}

/// The message for `name=value` that its variable does not accept.
fn refused(var: &Var, value: &str, why: &str) -> String {
    format!(
        "{}={value:?} cannot be read ({why}): it takes {}; fix or unset it",
        var.name, var.accepts
    )
}

/// Variable `name` read by `parse`: `None` when unset, an error saying the accepted forms when
/// unreadable.
fn read<T>(name: &str, parse: fn(&str) -> Result<T, String>) -> Result<Option<T>, String> {
    let Some(value) = std::env::var_os(name) else {
        return Ok(None);
    };
    let var = VARS.iter().find(|v| v.name == name);
    let value = value.to_string_lossy();
    parse(&value).map(Some).map_err(|why| match var {
        Some(var) => refused(var, &value, &why),
        None => format!("{name}={value:?} cannot be read ({why})"),
    })
}

/// A size variable's value: `None` when unset, an error when unreadable.
pub fn size_var(name: &str) -> Result<Option<u64>, String> {
    read(name, parse_size)
}

/// The limits `POSLAB_MAX_PARAMS` and `POSLAB_MAX_MEMORY` set, each else its default
/// ([`poslab::limits::Limits::default`]); an unreadable value is an error saying the accepted
/// forms.
pub fn limits() -> Result<poslab::limits::Limits, String> {
    let default = poslab::limits::Limits::default();
    Ok(poslab::limits::Limits {
        max_params: size_var("POSLAB_MAX_PARAMS")?.unwrap_or(default.max_params),
        max_memory: size_var("POSLAB_MAX_MEMORY")?.unwrap_or(default.max_memory),
    })
}

/// The kernels `POSLAB_KERNELS` names, if it is set; an unreadable value is an error saying
/// the accepted forms.
pub fn kernels() -> Result<Option<poslab::nn::Kernels>, String> {
    read("POSLAB_KERNELS", parse_kernels)
}

/// Checks every `POSLAB_*` variable set: a known one's value must be one it accepts (else an
/// error saying the accepted forms); an unknown name is returned as a warning.
pub fn check() -> Result<Vec<String>, String> {
    let mut warnings = Vec::new();
    let mut set: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| {
            let k = k.to_string_lossy().into_owned();
            k.starts_with("POSLAB_")
                .then(|| (k, v.to_string_lossy().into_owned()))
        })
        .collect();
    set.sort();
    for (name, value) in set {
        match VARS.iter().find(|v| v.name == name) {
            Some(var) => (var.check)(&value).map_err(|why| refused(var, &value, &why))?,
            None => warnings.push(format!(
                "warning: {name} is not a variable poslab reads, so it changes nothing (poslab \
                 reads {})",
                VARS.iter().map(|v| v.name).collect::<Vec<_>>().join(", ")
            )),
        }
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_refuse_an_environment_they_cannot_read() {
        // A name of its own: the tests run in parallel threads of one process.
        std::env::set_var("POSLAB_TEST_LIMIT", "1.5G");
        let err = size_var("POSLAB_TEST_LIMIT").unwrap_err();
        assert!(
            err.contains("POSLAB_TEST_LIMIT=\"1.5G\" cannot be read"),
            "{err}"
        );
        std::env::set_var("POSLAB_TEST_LIMIT", "3G");
        assert_eq!(size_var("POSLAB_TEST_LIMIT"), Ok(Some(3 << 30)));
        std::env::remove_var("POSLAB_TEST_LIMIT");
        assert_eq!(size_var("POSLAB_TEST_LIMIT"), Ok(None));
    }

    #[test]
    fn sizes_are_whole_numbers_with_a_binary_suffix() {
        assert_eq!(parse_size("3G"), Ok(3 << 30));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert_eq!(parse_size(" 8k "), Ok(8 << 10));
        for bad in [
            "1.5G",
            "0.05M",
            "1e9",
            "0x100",
            "-5",
            "lots",
            "",
            "G",
            "0",
            "99999999999999999999",
            "20000000T",
            "+5",
            "5GB",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
