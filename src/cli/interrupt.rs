//! Ctrl-C during a run: say what is kept and the command that continues, then end as an
//! interrupt ends a process (exit status 130).
//!
//! SIGINT is blocked in the main thread before any other starts (so in every thread, which
//! inherit the mask) and taken by one thread of its own with `sigwait`, where anything may be
//! done: read the run folder, print, exit. Run folders are written atomically, so ending the
//! process there loses nothing but the cells in flight.

use std::sync::{Arc, Mutex};

type Message = Box<dyn Fn() -> String + Send>;

/// Where a command leaves what an interrupt should say.
#[derive(Clone, Default)]
pub struct Interrupt(Arc<Mutex<Option<Message>>>);

impl Interrupt {
    /// Takes SIGINT from now on: call it first thing, before any thread starts. Where it cannot
    /// (no thread), Ctrl-C keeps its default and ends the process at once.
    pub fn install() -> Self {
        let this = Self::default();
        // SAFETY: sigset_t is plain data, initialised by sigemptyset before use; the calls
        // change this thread's signal mask only.
        let set = unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            set
        };
        let mask = |how| unsafe { libc::pthread_sigmask(how, &set, std::ptr::null_mut()) };
        if mask(libc::SIG_BLOCK) != 0 {
            return this;
        }
        let message = this.0.clone();
        let waiter = std::thread::Builder::new()
            .name("interrupt".into())
            .spawn(move || {
                let mut signal = 0;
                // SAFETY: `set` is initialised and SIGINT is blocked in every thread, so
                // sigwait takes it here.
                if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
                    return;
                }
                let said = message
                    .lock()
                    .ok()
                    .and_then(|m| m.as_ref().map(|say| say()));
                errln!("");
                if let Some(said) = said {
                    errln!("{said}");
                }
                std::process::exit(130);
            });
        if waiter.is_err() {
            mask(libc::SIG_UNBLOCK);
        }
        this
    }

    /// What an interrupt from now on says (computed when it comes).
    pub fn says(&self, message: impl Fn() -> String + Send + 'static) {
        if let Ok(mut m) = self.0.lock() {
            *m = Some(Box::new(message));
        }
    }
}

/// The command line this process was started with, quoted for a POSIX shell where needed,
/// without the flags `leave_out` names (`--overwrite`: continuing must not start over) and the
/// testing flag `--kill-at`: what continues the same run.
pub fn this_command(leave_out: &[&str]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut args = std::env::args_os().skip(1);
    out.push("poslab".into());
    while let Some(arg) = args.next() {
        let arg = arg.to_string_lossy().into_owned();
        if arg == "--kill-at" {
            args.next();
            continue;
        }
        if arg.starts_with("--kill-at=") || leave_out.contains(&arg.as_str()) {
            continue;
        }
        out.push(quote(&arg));
    }
    out.join(" ")
}

fn quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    match plain {
        true => arg.to_string(),
        false => format!("'{}'", arg.replace('\'', r"'\''")),
    }
}
