//! How a long job shows where it is: progress bars on a terminal, or, when standard error is
//! not a terminal (a Slurm or Kubernetes job's log, `nohup`, a pipe), one plain line at a
//! steady interval saying which cells run, their step and loss, the time spent and the time
//! left. Work that is not training (a predict's batches, an analysis's texts) shows the same
//! way through a [`Meter`].

use std::io::IsTerminal as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Progress bars (standard error is a terminal).
    Bars,
    /// A line every `every` (standard error is a log file or a pipe).
    Lines {
        /// The interval between lines.
        every: Duration,
    },
    /// Neither: only a line per finished cell.
    Quiet,
}

impl Progress {
    /// The interval of [`Progress::Lines`] unless asked otherwise.
    pub const DEFAULT_EVERY: Duration = Duration::from_secs(30);

    /// Bars where standard error is a terminal, lines every `every` elsewhere, nothing when
    /// `quiet`.
    pub fn for_stderr(quiet: bool, every: Duration) -> Self {
        if quiet {
            Self::Quiet
        } else if std::io::stderr().is_terminal() {
            Self::Bars
        } else {
            Self::Lines { every }
        }
    }

    /// Whether this shows bars.
    pub fn bars(self) -> bool {
        self == Self::Bars
    }
}

/// `45s`, `4m 10s`, `2h 05m`, `3d 04h`.
pub fn human_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// What one running job is doing.
#[derive(Clone, Debug)]
struct Job {
    name: String,
    step: usize,
    planned: usize,
    loss: Option<f64>,
    testing: bool,
}

#[derive(Debug, Default)]
struct State {
    running: Vec<Job>,
    cells_done: usize,
    steps_done: u64,
}

/// The state of a run's jobs, updated as they go and read by the log lines.
#[derive(Debug)]
pub struct Board {
    /// `compare`, or a `train` run's name.
    what: String,
    /// Cells this process runs (0: a single model, no cell count).
    cells: usize,
    /// Training steps this process has planned, over every job.
    steps: u64,
    started: Instant,
    state: Mutex<State>,
}

impl Board {
    /// A board for `cells` cells (0 for one model) and `steps` planned training steps.
    pub fn new(what: &str, cells: usize, steps: u64) -> Self {
        Self {
            what: what.into(),
            cells,
            steps,
            started: Instant::now(),
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panicking job poisons nothing worth refusing to print.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `n` cells were finished by an earlier run (a resumed compare).
    pub fn done_before(&self, n: usize) {
        self.state().cells_done += n;
    }

    /// A job starts at `step` (0, or the step a resumed run continues from) of `planned`.
    pub fn start(&self, name: &str, step: usize, planned: usize) {
        self.state().running.push(Job {
            name: name.into(),
            step,
            planned,
            loss: None,
            testing: false,
        });
    }

    /// A job finished a training step with this loss.
    pub fn step(&self, name: &str, step: usize, loss: f64) {
        let mut state = self.state();
        state.steps_done += 1;
        if let Some(job) = state.running.iter_mut().find(|j| j.name == name) {
            job.step = step;
            job.loss = Some(loss);
        }
    }

    /// A job has finished training and is being tested.
    pub fn testing(&self, name: &str) {
        if let Some(job) = self.state().running.iter_mut().find(|j| j.name == name) {
            job.testing = true;
        }
    }

    /// A job is done (or failed).
    pub fn finish(&self, name: &str, done: bool) {
        let mut state = self.state();
        state.running.retain(|j| j.name != name);
        if done {
            state.cells_done += 1;
        }
    }

    /// One line: what runs, where each job is, the time spent and the time left (from the
    /// training steps done so far in this process).
    pub fn line(&self) -> String {
        let state = self.state();
        let elapsed = self.started.elapsed();
        let jobs: Vec<String> = state
            .running
            .iter()
            .map(|j| {
                let name = if self.cells == 0 {
                    String::new()
                } else {
                    format!("{} ", j.name)
                };
                match (j.testing, j.loss) {
                    (true, _) => format!("{name}testing"),
                    (false, Some(loss)) => {
                        format!("{name}step {}/{} loss {loss:.4}", j.step, j.planned)
                    }
                    (false, None) => format!("{name}step {}/{}", j.step, j.planned),
                }
            })
            .collect();
        let mut line = format!("{}: ", self.what);
        if self.cells > 0 {
            line.push_str(&format!("{}/{} cells done", state.cells_done, self.cells));
            if !jobs.is_empty() {
                line.push_str("; ");
            }
        }
        line.push_str(&jobs.join(", "));
        line.push_str(&format!("; {} elapsed", human_duration(elapsed)));
        if let Some(left) = time_left(elapsed, state.steps_done as f64, self.steps as f64) {
            line.push_str(&format!(
                ", about {} of training left",
                human_duration(left)
            ));
        }
        line
    }
}

/// The time left of work of which `done` of `all` (in any unit) took `elapsed`, once some is done
/// and some is left.
fn time_left(elapsed: Duration, done: f64, all: f64) -> Option<Duration> {
    (done > 0.0 && all > done)
        .then(|| Duration::from_secs_f64(elapsed.as_secs_f64() * (all - done) / done))
}

/// Runs `work`; meanwhile a thread calls `tick` after `first`, then every `every`, until the
/// work ends.
fn ticking<R>(
    first: Duration,
    every: Duration,
    tick: &(dyn Fn() + Sync),
    work: impl FnOnce() -> R,
) -> R {
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let mut wait = first;
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(wait) {
                wait = every;
                tick();
            }
        });
        let result = work();
        drop(stop);
        result
    })
}

/// Runs `work`; with [`Progress::Lines`], a thread meanwhile hands `board`'s line to `sink`
/// every interval (also while a job is being tested, when no step advances).
pub fn with_lines<R>(
    progress: Progress,
    board: &Board,
    sink: &(dyn Fn(&str) + Sync),
    work: impl FnOnce() -> R,
) -> R {
    match progress {
        Progress::Lines { every } => ticking(every, every, &|| sink(&board.line()), work),
        _ => work(),
    }
}

/// Where work that is not training stands (the batches of a `predict` or an `embed`, the
/// texts of an analysis): parts planned with their costs, the part running now, the time
/// spent and the time left.
#[derive(Debug)]
pub struct Meter {
    what: String,
    started: Instant,
    state: Mutex<MeterState>,
}

#[derive(Debug, Default)]
struct MeterState {
    unit: String,
    parts: usize,
    done: usize,
    cost: f64,
    cost_done: f64,
    now: String,
}

impl Meter {
    /// A meter for `what` (the command), with nothing planned yet.
    pub fn new(what: &str) -> Self {
        Self {
            what: what.into(),
            started: Instant::now(),
            state: Mutex::new(MeterState::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MeterState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The work is `parts` parts named `unit` (`batch`), of `cost` in all (any unit: the time
    /// left is the time spent scaled by the cost left).
    pub fn plan(&self, unit: &str, parts: usize, cost: f64) {
        let mut state = self.state();
        state.unit = unit.into();
        state.parts = parts;
        state.cost = cost;
    }

    /// The next part starts; `now` says what it holds (`1 text of 16000 tokens`).
    pub fn start(&self, now: String) {
        self.state().now = now;
    }

    /// The running part is done; it cost `cost`.
    pub fn done(&self, cost: f64) {
        let mut state = self.state();
        state.done += 1;
        state.cost_done += cost;
        state.now.clear();
    }

    /// One line: the part running and what it holds, the time spent and, once a part is
    /// done, the time left.
    pub fn line(&self) -> String {
        let state = self.state();
        let elapsed = self.started.elapsed();
        let mut line = format!("{}: ", self.what);
        if state.parts > 0 {
            let at = (state.done + 1).min(state.parts);
            line += &format!("{} {at} of {}", state.unit, state.parts);
            if !state.now.is_empty() {
                line += &format!(" ({})", state.now);
            }
            line += "; ";
        }
        line += &format!("{} elapsed", human_duration(elapsed));
        if let Some(left) = time_left(elapsed, state.cost_done, state.cost) {
            line += &format!(", about {} left", human_duration(left));
        }
        line
    }
}

/// How long work runs before [`with_meter`] shows a bar: shorter work finishes in silence.
pub const QUIET_FOR: Duration = Duration::from_secs(1);

/// Runs `work`; meanwhile `meter`'s line shows as a bar on standard error after
/// [`QUIET_FOR`] ([`Progress::Bars`]), or goes to `sink` every interval ([`Progress::Lines`]).
pub fn with_meter<R>(
    progress: Progress,
    meter: &Meter,
    sink: &(dyn Fn(&str) + Sync),
    work: impl FnOnce() -> R,
) -> R {
    let every = match progress {
        Progress::Quiet => return work(),
        Progress::Lines { every } => {
            return ticking(every, every, &|| sink(&meter.line()), work);
        }
        Progress::Bars => Duration::from_millis(200),
    };
    let bar = std::sync::OnceLock::<indicatif::ProgressBar>::new();
    let tick = || {
        let bar = bar.get_or_init(|| {
            let bar = indicatif::ProgressBar::with_draw_target(
                None,
                indicatif::ProgressDrawTarget::stderr(),
            );
            bar.set_style(
                indicatif::ProgressStyle::with_template("{spinner} {msg}")
                    .expect("a valid template"),
            );
            bar
        });
        bar.set_message(meter.line());
        bar.tick();
    };
    let result = ticking(QUIET_FOR, every, &tick, work);
    if let Some(bar) = bar.get() {
        bar.finish_and_clear();
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_at_a_glance() {
        let s = Duration::from_secs;
        assert_eq!(human_duration(s(45)), "45s");
        assert_eq!(human_duration(s(250)), "4m 10s");
        assert_eq!(human_duration(s(2 * 3600 + 5 * 60 + 9)), "2h 05m");
        assert_eq!(human_duration(s(3 * 86_400 + 4 * 3600)), "3d 04h");
    }

    #[test]
    fn a_line_says_what_runs_where() {
        let board = Board::new("compare", 4, 200);
        board.start("t/rope/seed0", 0, 100);
        board.start("t/none/seed0", 0, 100);
        board.step("t/rope/seed0", 1, 0.5);
        board.testing("t/none/seed0");
        let line = board.line();
        assert!(
            line.starts_with(
                "compare: 0/4 cells done; t/rope/seed0 step 1/100 loss 0.5000, t/none/seed0 testing; "
            ) && line.contains(" elapsed, about ")
                && line.ends_with(" of training left"),
            "{line}"
        );
        board.finish("t/none/seed0", true);
        assert!(board
            .line()
            .starts_with("compare: 1/4 cells done; t/rope/seed0"));
        let single = Board::new("reviews", 0, 10);
        single.start("reviews", 4, 10);
        assert!(
            single.line().starts_with("reviews: step 4/10; "),
            "{}",
            single.line()
        );
    }

    #[test]
    fn a_meter_says_which_part_runs_and_the_time_left() {
        let meter = Meter::new("predict");
        assert!(
            meter.line().starts_with("predict: 0s elapsed"),
            "{}",
            meter.line()
        );
        meter.plan("batch", 3, 10.0);
        meter.start("1 text of 16000 tokens".into());
        let line = meter.line();
        assert!(
            line.starts_with("predict: batch 1 of 3 (1 text of 16000 tokens); ")
                && !line.contains("left"),
            "{line}"
        );
        meter.done(5.0);
        meter.start("32 texts of at most 12 tokens".into());
        let line = meter.line();
        assert!(
            line.starts_with("predict: batch 2 of 3 (32 texts of at most 12 tokens); ")
                && line.ends_with(" left"),
            "{line}"
        );
    }

    #[test]
    fn meter_lines_come_while_the_work_runs_and_never_when_quiet() {
        let meter = Meter::new("w");
        let lines = Mutex::new(Vec::new());
        let sink = |l: &str| lines.lock().unwrap().push(l.to_string());
        let every = Duration::from_millis(20);
        let value = with_meter(Progress::Lines { every }, &meter, &sink, || {
            std::thread::sleep(Duration::from_millis(150));
            7
        });
        assert_eq!(value, 7);
        let n = lines.lock().unwrap().len();
        assert!((1..=8).contains(&n), "{n} lines in 150 ms at 20 ms");
        assert!(lines.lock().unwrap()[0].starts_with("w: "));
        with_meter(Progress::Quiet, &meter, &sink, || {
            std::thread::sleep(Duration::from_millis(50))
        });
        assert_eq!(lines.lock().unwrap().len(), n, "quiet prints nothing");
    }

    #[test]
    fn lines_come_while_the_work_runs() {
        let board = Board::new("w", 0, 1);
        let lines = Mutex::new(Vec::new());
        let sink = |l: &str| lines.lock().unwrap().push(l.to_string());
        let every = Duration::from_millis(20);
        let value = with_lines(Progress::Lines { every }, &board, &sink, || {
            std::thread::sleep(Duration::from_millis(150));
            7
        });
        assert_eq!(value, 7);
        let n = lines.lock().unwrap().len();
        assert!((1..=8).contains(&n), "{n} lines in 150 ms at 20 ms");
        with_lines(Progress::Quiet, &board, &sink, || {
            std::thread::sleep(Duration::from_millis(50))
        });
        assert_eq!(lines.lock().unwrap().len(), n, "quiet prints nothing");
    }
}
